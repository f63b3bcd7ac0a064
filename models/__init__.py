"""strata.models"""
