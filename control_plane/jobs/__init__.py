"""Jobs: submission, cancellation, deletion, their events, and what agents report about them."""
