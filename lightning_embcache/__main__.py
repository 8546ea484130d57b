"""`python -m lightning_embcache`: the same as the `embcache` command."""

import sys

from lightning_embcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
