"""`ember router`: a cache-aware HTTP router in front of several `ember serve` workers."""
