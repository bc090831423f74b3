"""One module per `ringleader` command, each with add_parser(subparsers) and run(args);
hostctl.cli builds the parser from them and dispatches.  Beside them, what several commands
share: serve_flags (the config fields' flags of serve, which the bench writes too),
client_options, cannot_start and http_fronts (serve's --http and --metrics)."""
