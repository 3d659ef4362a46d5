"""`python -m nailseg.bench`: the command; the code is nailseg.tools.bench."""

from nailseg.tools.bench import main

if __name__ == "__main__":
    main()
