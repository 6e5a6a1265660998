"""Prompt datasets, text encoders and the small image data the demo trains on."""
