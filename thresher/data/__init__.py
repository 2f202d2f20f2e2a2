"""Text sources, tokenized calibration / evaluation windows, and the demo model builder."""
