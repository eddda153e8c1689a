"""Built-in Composer callbacks, registered in ``foundryx.registry.callbacks`` by entry points."""
