"""`python -m cs336_systems.train --help`: see `cs336_systems.train`."""

from cs336_systems.train import main

if __name__ == "__main__":
    main()
