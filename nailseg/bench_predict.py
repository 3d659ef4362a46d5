"""`python -m nailseg.bench_predict`: the command; the code is nailseg.tools.bench_predict."""

from nailseg.tools.bench_predict import main

if __name__ == "__main__":
    main()
