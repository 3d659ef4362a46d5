"""nailseg's I/O layer: the only code that creates, replaces or deletes a file or folder."""
