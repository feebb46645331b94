"""incr_prefix: resume each chunk's radix-tree insert from the node the previous chunk reached."""
