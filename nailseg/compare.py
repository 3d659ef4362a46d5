"""`python -m nailseg.compare`: the command; the code is nailseg.tools.compare."""

from nailseg.tools.compare import main

if __name__ == "__main__":
    main()
