"""``python -m vramguard`` runs the command-line interface."""

from vramguard.cli import main

main()
