"""`python -m nailseg.predict`: the command; the code is nailseg.inference.predict."""

from nailseg.inference.predict import main

if __name__ == "__main__":
    main()
