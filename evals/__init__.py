"""Evals: perplexity and retrieval over long texts, scored against KV-cache memory."""
