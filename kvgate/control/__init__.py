"""The control plane: the poller, engine discovery, metrics parsing, status rendering."""
