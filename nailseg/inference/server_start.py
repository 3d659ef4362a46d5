"""Imported by predict's forkserver, and only there, before its preload: the server dies with the
predict process that started it (lifetime.py), and its workers with it. (Each worker holds the
other end of the pipe the server watches, so neither would see it close.)
"""

from nailseg.lifetime import die_with_parent

die_with_parent()
