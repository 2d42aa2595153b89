from longstraw_cli.resident.state import AttentionPages, RecurrentState, Resident

__all__ = ["AttentionPages", "RecurrentState", "Resident"]
