"""The command line: thin typer commands over the library; the only place that imports rich."""
