"""Files as every writer of an index handles them, one concern per module: durable writes
(`durable`), checksums of what a manifest records (`checksums`), locks and their owners
(`locks`), the time a record carries (`clock`), named crash points (`crash_points`), and what a
directory of indexes is asked without opening one (`index_directory`).

The lowest unit of the library: its modules import nothing else of espn, so the index
directory, the build job and the live writer can all use them. Import from the module that
holds a name; this package re-exports nothing.
"""
