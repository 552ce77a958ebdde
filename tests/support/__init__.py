"""What the test modules share (fixtures live in tests/conftest.py); test modules import from here and
never from one another.

- ``bounds``: every await and scenario bounded (``within``, ``run``, ``until``; ``QUICK_S``, ``MODEL_S``).
- ``audio``: the speech fixtures of ``samples/``, WAV/FLAC files built for a test, speech decoded back.
- ``clients``: request bodies, bounded HTTP clients, the documented error shape, raw HTTP exchanges.
- ``processes``: one way to start a server and wait for it (``start_serve``), one ``kill_process_tree``,
  processes as the kernel sees them, system programs some tests need.
- ``stacks``: ``manage.py serve`` on a fresh PostgreSQL database and Redis db (``run_stack``).
- ``cluster``: web processes and workers started one by one on one Redis and database (``run_cluster``).
- ``rigs``: the scheduler driven directly on Redis database 15, without a server.
- ``records``: validation evidence records and the ``admission`` command.
"""
