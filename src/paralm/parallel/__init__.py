"""How the model is spread over ranks: dims and mesh, launch, and the parallel wrappers."""
