"""Bootstrap files that ``smartckpt run`` puts on PYTHONPATH (shipped in the wheel as
``smartckpt_cli.hooks``). The directory itself, not this package, goes on the path, so that its
``sitecustomize`` module is what the child interpreter imports at start-up."""
