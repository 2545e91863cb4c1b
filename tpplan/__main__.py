from .cli.app import main

if __name__ == "__main__":  # not when a spawned worker imports the parent's main module (tpplan fit --jobs)
    main()
