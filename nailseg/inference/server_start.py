"""Imported by predict's forkserver, and only there, before the modules it preloads: the server
dies with the predict process that started it (lifetime.py), and its workers die with it.

The server would exit by itself once the pipe it watches closes, but every worker it forks holds
that pipe's other end too (so that a worker could start processes through it), and a worker of a
predict killed outright waits for tasks forever: neither ever saw the other end.
"""

from nailseg.lifetime import die_with_parent

die_with_parent()
