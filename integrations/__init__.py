"""Framework adapters for rankguard: Composer and Lightning callbacks."""
