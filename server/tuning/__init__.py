"""Tuning the semantic layer: labelled pairs and their split, training the cross-encoder, calibrating tiers."""
