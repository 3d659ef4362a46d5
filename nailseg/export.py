"""`python -m nailseg.export`: the command; the code is nailseg.inference.export."""

from nailseg.inference.export import main

if __name__ == "__main__":
    main()
