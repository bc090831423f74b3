"""ringleader on Ray Serve: one engine per replica behind Ray Serve's HTTP proxy (docs/scale-out.md).

Only this package imports ray (the optional extra `ray`); app.py's build_app is the entry point
of `serve run` and of Ray Serve config files."""
