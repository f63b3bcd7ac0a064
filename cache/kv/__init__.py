"""strata.cache.kv"""
