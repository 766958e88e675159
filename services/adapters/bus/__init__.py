"""The bus port and its backends."""
