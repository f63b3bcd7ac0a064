"""strata.cache.request"""
