"""A rank's sharded state as data: flat groups, parameter storage, step counts, parameter edits."""
