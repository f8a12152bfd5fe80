"""What no caching policy can beat: the infinite cache, Belady's offline optimum at the same
capacity, and their pooled and tiered forms (`oracle.py`)."""
