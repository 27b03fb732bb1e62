"""Generated from protos/ by scripts/protos; never edited by hand."""
