"""Building blocks shared by models: attention, norms, feed-forward blocks, positions."""
