"""One module per op family: argument handling and backend dispatch."""
