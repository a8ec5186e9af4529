from .grid import ProcessGrid

__all__ = ["ProcessGrid"]
