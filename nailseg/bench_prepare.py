"""`python -m nailseg.bench_prepare`: the command; the code is nailseg.tools.bench_prepare."""

from nailseg.tools.bench_prepare import main

if __name__ == "__main__":
    main()
