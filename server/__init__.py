"""strata.server"""
