"""``evolving soak``: a bounded soak of the live stack.

It starts ``evolving up`` on loopback (simulated engines), or attaches to a running one, sends
streaming chat requests through the gateway at a Poisson rate over N agent streams (multi-turn
sessions with branch headers and forks, so prefixes are reused), samples every process's RSS
and open files, and at the end checks that every request was answered, every event of the
stream is a row of the recorder's DuckDB log, ``verify`` reproduces every decision, and that
nothing grows over the second half of the run.

Modules: :mod:`.stats` (the accounting and the flatness verdicts, pure), :mod:`.load` (the
traffic), :mod:`.procs` (RSS and fds per process), :mod:`.stack` (start / attach, the stream and
log checks), :mod:`.run` (the run), :mod:`.report` (progress, tables, plot), :mod:`.cli`.
docs/chaos.md ("Soak") has the long form and the measured figures.
"""
