"""``python -m vramguard.cli`` runs the command-line interface, as ``python -m vramguard`` does."""

from vramguard.cli import main

main()
