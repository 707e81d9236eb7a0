"""Model families: per family a plain module and a spec of what the parallel strategies need to know."""
