"""An example foundryx plugin."""
