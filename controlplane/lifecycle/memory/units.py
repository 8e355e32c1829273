"""The one unit the memory accounting speaks besides bytes."""

MIB = 1024 * 1024
