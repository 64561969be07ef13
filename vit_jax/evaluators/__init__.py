"""Evaluators: each takes a function of images (never a trainer) and returns metrics."""
