"""Heads on disk and on the Hub: saving, loading, other layouts (Medusa, Clover-2), model cards."""
