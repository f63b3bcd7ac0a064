"""strata.cache"""
