"""kvstore-cli: the operator's command line for a kvstore daemon (see kvstore_cli.main)."""
