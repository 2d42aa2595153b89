from longstraw_cli.resident.state import AttentionPages, MLAPages, RecurrentState, Resident

__all__ = ["AttentionPages", "MLAPages", "RecurrentState", "Resident"]
