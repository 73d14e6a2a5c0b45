from control_plane.cli import main

main()
