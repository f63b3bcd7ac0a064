"""The OpenAI-compatible HTTP layer: routes, the request path through the caches, auth, errors, metrics."""
