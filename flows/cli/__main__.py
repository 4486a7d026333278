"""``python -m flows.cli`` (and ``torchrun … -m flows.cli``): the ``aepo`` command line."""

from flows.cli import main

if __name__ == "__main__":  # pragma: no cover
    main()
