"""What --workers N share: the memory-mapped load board, its ledger and breakers, wake-ups, the supervisor."""
