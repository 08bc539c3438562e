"""One module per `nanopt` subcommand, each with `main(argv) -> exit code`; nanopt/cli.py dispatches to them."""
