"""The server: a ROUTER frontend, admission into the rings, completion routing, metrics, shutdown."""
